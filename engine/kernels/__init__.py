"""Triton kernels for the paged KV cache (layout in :mod:`engine.attention.base`).

One kernel per module, each as kernel -> launcher (asserts on shapes, strides, dtypes)
-> public function:

* :mod:`engine.kernels.kv_write`          store new K/V at slot-mapping positions;
* :mod:`engine.kernels.decode_attention`  paged GQA decode, split-K + log-sum-exp merge;
* :mod:`engine.kernels.extend_attention`  causal prefill/extend over a cached prefix;
* :mod:`engine.kernels.reference`         pure-torch references, independent of all three.

The CPU backend's own kernels live beside them: :mod:`engine.kernels.cpu_native_attention`
(native AVX-512 code in ``native/``, built by :mod:`engine.kernels.native_build`) and
:mod:`engine.kernels.cpu_decode_attention` (numba), checked against the same references.

On CPU the Triton kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, which must
be set before these modules are imported, since ``triton.jit`` reads it then).
"""
