"""``kvtoll worker``: one engine behind the OpenAI-compatible worker server.

Workers are internal services: put them where only the kvtoll proxy can reach
them (``kvtoll serve --worker URL``). Every request must carry the worker token
(``KVTOLL_WORKER_TOKEN`` / ``--worker-token``; during a rotation also the previous
one, ``KVTOLL_WORKER_TOKEN_PREVIOUS`` / ``--worker-token-previous``), refused empty
outside dev mode; they honour the prefix-cache salt the proxy sends in
``cache_salt`` only from such callers and never derive one themselves.
``--tls-cert``/``--tls-key`` serve https. Every caller mistake
(bad flag value, missing model file, port in use) prints one line and exits 2
before anything is loaded.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer

from engine.config import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    LINEAR_QUANTS,
    TINY_MODEL,
    EngineConfig,
)
from engine.kernels.kv_int8 import KV_CACHE_DTYPES
from engine.kv.tier.codec import TierMode
from engine.kv.tier.config import TierConfig
from engine.serving.app import WorkerConfig
from engine.serving.registration import Registration
from kvtoll.cli.errors import fail
from kvtoll.logs import configure_logging
from kvtoll.openai.errors import DEFAULT_MAX_BODY_BYTES
from kvtoll.server import check_port_free, check_tls_files
from kvtoll.settings import Settings, load_settings
from kvtoll.worker_auth import WorkerTokens

DEFAULT_PORT = 8001
_MIB = 1024 * 1024
MAX_BODY_MB = 1024.0
MAX_HEARTBEAT_TTL_S = 86_400.0
MAX_KV_TIER_MB = 16 * 1024 * 1024  # 16 TiB: anything larger is a typo


def engine_config(
    model: str | None,
    dtype: str | None,
    *,
    block_size: int = 16,
    num_blocks: int | None = None,
    kv_cache_mb: int | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int = 64,
    max_batched_tokens: int = 2048,
    max_n: int = 8,
    attention_backend: str = "auto",
    device: str = "cpu",
    cuda_graphs: bool = False,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    kv_tier: TierConfig | None = None,
    linear_quant: str = "none",
    kv_cache_dtype: str = "auto",
) -> EngineConfig:
    """The engine's config from CLI values; ``ValueError`` names a bad one."""
    if model not in (None, TINY_MODEL) and not Path(str(model)).exists():
        raise ValueError(f"model not found: {model}")
    if cuda_graphs and attention_backend not in ("auto", "triton"):
        raise ValueError(f"--cuda-graphs needs the triton attention backend, not "
                         f"{attention_backend!r} (KVTOLL_ATTENTION_BACKEND)")  # fmt: skip
    if cuda_graphs and not device.startswith("cuda"):
        raise ValueError(f"--cuda-graphs needs a CUDA device (--device cuda), not {device!r}")
    if linear_quant not in LINEAR_QUANTS:
        raise ValueError(f"--linear-quant must be one of {', '.join(LINEAR_QUANTS)}, "
                         f"got {linear_quant!r}")  # fmt: skip
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {kv_cache_dtype!r}")  # fmt: skip
    extra: dict[str, object] = {}
    if dtype is not None:
        extra["dtype"] = dtype
    if kv_cache_mb is not None:
        if kv_cache_mb <= 0:
            raise ValueError(f"--kv-cache-mb must be positive, got {kv_cache_mb}")
        extra["kv_cache_bytes"] = kv_cache_mb * _MIB
    return EngineConfig(
        model=model,
        block_size=block_size,
        num_kv_blocks=num_blocks,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_batched_tokens,
        max_n=max_n,
        attention_backend=attention_backend,
        device=device,
        cuda_graphs=cuda_graphs,
        gpu_memory_utilization=gpu_memory_utilization,
        kv_tier=kv_tier,
        linear_quant=linear_quant,
        kv_cache_dtype=kv_cache_dtype,
        **extra,  # type: ignore[arg-type]
    )


def tier_config(
    settings: Settings, kv_tier_mb: int, kv_shared: str, redis_url: str | None
) -> TierConfig | None:
    """Tier 2 from ``--kv-tier-mb`` / ``--kv-shared`` and the ``KVTOLL_KV_TIER_*``
    settings; None when off; ``ValueError`` names a bad value."""
    if not 0 <= kv_tier_mb <= MAX_KV_TIER_MB:
        raise ValueError(f"--kv-tier-mb must be in 0..{MAX_KV_TIER_MB}, got {kv_tier_mb}")
    if kv_shared not in ("redis", "peer", "off"):
        raise ValueError(f"--kv-shared must be redis, peer or off, got {kv_shared!r}")
    if kv_tier_mb == 0:
        if kv_shared != "off":
            raise ValueError("--kv-shared needs a host tier: set --kv-tier-mb")
        return None
    try:
        mode = TierMode(settings.kv_tier_mode)
    except ValueError:
        raise ValueError(f"KVTOLL_KV_TIER_MODE must be raw or int8, "
                         f"got {settings.kv_tier_mode!r}") from None  # fmt: skip
    spill = settings.kv_tier_spill_dir
    return TierConfig(
        host_bytes=kv_tier_mb * _MIB,
        tenant_fraction=settings.kv_tier_tenant_fraction,
        mode=mode,
        spill_dir=Path(spill) if spill else None,
        spill_bytes=settings.kv_tier_spill_mb * _MIB,
        shared=kv_shared,
        redis_url=redis_url,
        ttl_s=settings.kv_tier_ttl_s,
        timeout_s=settings.kv_tier_timeout_s,
    )


def _serve(
    config: EngineConfig,
    worker: WorkerConfig,
    host: str,
    port: int,
    log_level: str,
    registration: Registration | None,
    tls: tuple[str, str] | None,
) -> None:
    from engine.factory import build_engine
    from engine.serving.server import serve_worker

    configure_logging(log_level)
    try:
        engine = build_engine(config)
    except (OSError, ValueError) as exc:
        fail(f"cannot load the model: {exc}")
    try:
        typer.echo(
            f"kvtoll worker: {engine.model_name} ({engine.dtype}) on http://{host}:{port}",
            err=True,
        )
        asyncio.run(serve_worker(engine, worker, host, port, log_level, registration, tls))
    finally:
        engine.shutdown()


def registration_for(
    redis_url: str | None,
    advertise_url: str | None,
    host: str,
    port: int,
    ttl_s: float,
    kv_events: str,
    tokens: WorkerTokens = WorkerTokens(),
    tls: bool = False,
) -> Registration | None:
    """The Redis registration (signed under ``tokens``), or ``None`` without a Redis
    URL or (dev mode) without a token to sign with; ``ValueError`` if bad."""
    if not redis_url:
        return None
    if not tokens.enabled:
        typer.echo("kvtoll worker: not announcing in Redis: no worker token to sign the "
                   "registration with (set KVTOLL_WORKER_TOKEN)", err=True)
        return None
    if kv_events not in ("redis", "http"):
        raise ValueError(f"--kv-events must be redis or http, got {kv_events!r}")
    if ttl_s <= 0:
        raise ValueError(f"--heartbeat-ttl must be positive, got {ttl_s}")
    if advertise_url is None:
        if host in ("0.0.0.0", "::", ""):
            raise ValueError("--advertise-url is required when listening on all interfaces")
        advertise_url = f"{'https' if tls else 'http'}://{host}:{port}"
    if not advertise_url.startswith(("http://", "https://")):
        raise ValueError(f"--advertise-url must be an http(s) URL, got {advertise_url!r}")
    return Registration(redis_url, advertise_url, ttl_s, kv_events,  # type: ignore[arg-type]
                        tokens=tokens.accepted())


def given(**flags: str | None) -> dict[str, str]:
    """The flags that were given, as ``load_settings`` overrides (flags win over env)."""
    return {name: value for name, value in flags.items() if value is not None}


def register(app: typer.Typer) -> None:
    """Add ``kvtoll worker`` to the root CLI."""

    @app.command("worker")
    def worker(
        host: Annotated[str, typer.Option(help="Interface to listen on")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="Port to listen on")] = DEFAULT_PORT,
        model: Annotated[
            str | None,
            typer.Option(
                help=f"GGUF file or HF directory (default: bundled SmolLM2; "
                f"'{TINY_MODEL}' for the random test model)"
            ),
        ] = None,
        dtype: Annotated[
            str | None,
            typer.Option(
                help="auto (bfloat16 where the CPU/GPU has it natively), float32, bfloat16"
            ),
        ] = None,
        block_size: Annotated[int, typer.Option(help="Tokens per KV block")] = 16,
        num_blocks: Annotated[
            int | None, typer.Option(help="KV blocks (default: from --kv-cache-mb)")
        ] = None,
        kv_cache_mb: Annotated[
            int | None,
            typer.Option(
                help="KV cache memory budget in MiB (default: 1024 on the CPU; on a GPU "
                "from --gpu-memory-utilization)"
            ),
        ] = None,
        gpu_memory_utilization: Annotated[
            float | None,
            typer.Option(
                help="On a GPU without --kv-cache-mb: the fraction of its memory the "
                "weights, activations and KV cache may take (default: "
                "KVTOLL_GPU_MEMORY_UTILIZATION or 0.9)"
            ),
        ] = None,
        max_model_len: Annotated[
            int | None, typer.Option(help="Context length (default: the model's)")
        ] = None,
        max_num_seqs: Annotated[int, typer.Option(help="Most sequences per step")] = 64,
        max_batched_tokens: Annotated[int, typer.Option(help="Token budget per step")] = 2048,
        max_n: Annotated[int, typer.Option(help="Largest n (choices) per request")] = 8,
        device: Annotated[
            str | None, typer.Option(help="cpu, cuda or cuda:N (default: KVTOLL_DEVICE or cpu)")
        ] = None,
        cuda_graphs: Annotated[
            bool | None,
            typer.Option(
                "--cuda-graphs/--no-cuda-graphs",
                help="Replay decode steps as CUDA graphs (Triton backend; "
                "default: KVTOLL_CUDA_GRAPHS or off)",
            ),
        ] = None,
        served_model_name: Annotated[
            list[str] | None, typer.Option(help="Model name(s) to answer to (repeatable)")
        ] = None,
        max_body_mb: Annotated[float, typer.Option(help="Largest request body in MiB")] = (
            DEFAULT_MAX_BODY_BYTES / _MIB
        ),
        redis_url: Annotated[
            str | None,
            typer.Option(help="Announce this worker in Redis (default: KVTOLL_REDIS_URL)"),
        ] = None,
        advertise_url: Annotated[
            str | None, typer.Option(help="URL proxies use to reach this worker")
        ] = None,
        heartbeat_ttl: Annotated[
            float, typer.Option(help="Seconds a Redis announcement lives without a beat")
        ] = 10.0,
        kv_events: Annotated[
            str, typer.Option(help="How the router gets KV events with Redis: redis or http")
        ] = "redis",
        worker_token: Annotated[
            str | None,
            typer.Option(help="Token every caller must send as a bearer (default: "
                         "KVTOLL_WORKER_TOKEN; required outside dev mode)"),
        ] = None,
        worker_token_previous: Annotated[
            str | None,
            typer.Option(help="Previous token, still accepted during a rotation (default: "
                         "KVTOLL_WORKER_TOKEN_PREVIOUS)"),
        ] = None,
        tls_cert: Annotated[
            str | None, typer.Option(help="Serve https with this certificate (PEM; default: "
                                     "KVTOLL_TLS_CERT)")
        ] = None,
        tls_key: Annotated[
            str | None, typer.Option(help="... and this private key (PEM; default: "
                                     "KVTOLL_TLS_KEY)")
        ] = None,
        kv_tier_mb: Annotated[
            int | None, typer.Option(help="Tier 2: host MiB for evicted KV blocks (0: off; "
                                     "default: KVTOLL_KV_TIER_MB or 0)")
        ] = None,
        kv_shared: Annotated[
            str | None, typer.Option(help="Tier 2 shared between workers: redis (from "
                                     "KVTOLL_REDIS_URL), peer or off (default: "
                                     "KVTOLL_KV_SHARED or off)")
        ] = None,
        linear_quant: Annotated[
            str, typer.Option(help="Linear layers: none (the model's dtype), or int8 (CPU: "
                              "int8 weights and dynamically quantized inputs; faster, not "
                              "token-identical to bf16)")
        ] = "none",
        kv_cache_dtype: Annotated[
            str, typer.Option(help="KV cache: auto (the model's dtype), or int8 (CPU: per "
                              "token and head int8 with its scale; ~1.9x the cached tokens "
                              "per MiB of bf16, not token-identical to it)")
        ] = "auto",
    ) -> None:
        """Run an engine worker: OpenAI API plus /kv/events and /load for the router.

        An internal service: expose it only to kvtoll proxies. Every request must carry
        the worker token; `cache_salt` is only read from such callers.
        """
        settings = load_settings(**given(
            worker_token=worker_token, worker_token_previous=worker_token_previous,
            tls_cert=tls_cert, tls_key=tls_key,
        ))
        try:
            tier = tier_config(
                settings,
                settings.kv_tier_mb if kv_tier_mb is None else kv_tier_mb,
                kv_shared or settings.kv_shared,
                redis_url or settings.redis_url,
            )
            config = engine_config(
                model or settings.model_path,
                dtype or settings.dtype,
                block_size=block_size,
                num_blocks=num_blocks,
                kv_cache_mb=kv_cache_mb,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                max_batched_tokens=max_batched_tokens,
                max_n=max_n,
                attention_backend=settings.attention_backend,
                device=device or settings.device,
                cuda_graphs=settings.cuda_graphs if cuda_graphs is None else cuda_graphs,
                gpu_memory_utilization=settings.gpu_memory_utilization
                if gpu_memory_utilization is None
                else gpu_memory_utilization,
                kv_tier=tier,
                linear_quant=linear_quant,
                kv_cache_dtype=kv_cache_dtype,
            )
            if not 0 < max_body_mb <= MAX_BODY_MB:  # NaN fails too
                raise ValueError(f"--max-body-mb must be in (0, {MAX_BODY_MB}], got {max_body_mb}")
            if not 0 < heartbeat_ttl <= MAX_HEARTBEAT_TTL_S:
                raise ValueError(f"--heartbeat-ttl must be in (0, {MAX_HEARTBEAT_TTL_S}] "
                                 f"seconds, got {heartbeat_ttl}")
            tokens = settings.worker_tokens()
            tls = check_tls_files(settings.tls_cert, settings.tls_key)
            check_port_free(host, port)
            registration = registration_for(
                redis_url or settings.redis_url, advertise_url, host, port, heartbeat_ttl,
                kv_events, tokens, tls is not None,
            )
        except ValueError as exc:
            fail(str(exc))
        names = tuple(served_model_name or ())
        worker_config = WorkerConfig(names, int(max_body_mb * _MIB), tokens)
        _serve(config, worker_config, host, port, settings.log_level, registration, tls)
