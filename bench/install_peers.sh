#!/usr/bin/env bash
# The gateways bench/proxy_overhead.py measures beside kvtoll, in the same run, as the
# issue names them: Portkey's open-source gateway (Node.js, from npm) and the LiteLLM
# proxy (Python, from PyPI, in a virtual environment of its own so that none of its
# dependencies reach the project's). Installed under .bench-peers/ (ignored by git);
# versions pinned so that runs compare like with like. Bifrost is not here: its npm
# launcher fetches a Go binary from its own site, which this machine cannot reach.
#
#   bench/install_peers.sh           # then: python bench/proxy_overhead.py
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.bench-peers
mkdir -p "$dest"
npm install --prefix "$dest/portkey" --no-audit --no-fund --loglevel error \
    @portkey-ai/gateway@1.15.2
if [ ! -x "$dest/litellm/bin/python" ]; then
    python3.11 -m venv "$dest/litellm"
fi
"$dest/litellm/bin/pip" install -q 'litellm[proxy]==1.108.7'
echo "peers installed under $dest"
