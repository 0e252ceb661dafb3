"""Triton kernels for the paged KV cache (layout in :mod:`engine.attention.base`).

One kernel per module, each as kernel -> launcher (asserts on shapes, strides, dtypes)
-> public function:

* :mod:`engine.kernels.kv_write`          store new K/V at slot-mapping positions;
* :mod:`engine.kernels.decode_attention`  paged GQA decode, split-K + log-sum-exp merge;
* :mod:`engine.kernels.extend_attention`  causal prefill/extend over a cached prefix;
* :mod:`engine.kernels.rope_kv_write`     RoPE on q/k fused with the KV write (optional);
* :mod:`engine.kernels.reference`         pure-torch references, independent of all three.

On CPU the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, which must
be set before these modules are imported, since ``triton.jit`` reads it then).
"""
