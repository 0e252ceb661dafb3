"""The OpenAI wire format, shared by the gateway and the worker server.

* ``protocol``  request schema (pydantic) and parse helpers -> 400s in OpenAI shape
* ``errors``    :class:`OpenAIError`, strict body reading, FastAPI error handlers
* ``responses`` chat.completion / chunk / text_completion builders, usage object
* ``sse``       server-sent events, written and read
"""
