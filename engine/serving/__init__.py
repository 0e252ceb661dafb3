"""The OpenAI-compatible HTTP face of an engine, shared by the worker and the proxy.

* ``protocol``  request schema (pydantic) and parse helpers -> 400s in OpenAI shape
* ``errors``    :class:`OpenAIError`, strict body reading, FastAPI error handlers
* ``convert``   request -> prompt token ids + ``SamplingParams`` (engine limits)
* ``generation`` run a prepared request on an engine: choices, usage, aborts
* ``responses`` chat.completion / chunk / text_completion builders, usage object
* ``sse``       server-sent events, written and read
* ``app``       ``build_worker_app(engine)``: the ``kvtoll worker`` server
* ``server``    uvicorn helpers; ``registration`` Redis heartbeat and KV-event stream
"""
