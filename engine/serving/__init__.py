"""The worker server: one engine behind the OpenAI API (``kvtoll worker``).

* ``app``           ``build_worker_app(engine)``: routes over :mod:`engine.api.generation`
* ``server``        the worker in the foreground under uvicorn (:mod:`kvtoll.server`)
* ``registration``  Redis heartbeat and KV-event stream (``kv_publish``)

The OpenAI wire format is :mod:`kvtoll.openai`; request conversion and generation,
which the gateway's in-process upstream shares, are in :mod:`engine.api`.
"""
