"""kvtoll's core: what every other package shares and nothing else.

* :mod:`kvtoll.settings`  process settings, read once from ``KVTOLL_*``
* :mod:`kvtoll.cli`       the ``kvtoll`` command's root and its one-line errors
* :mod:`kvtoll.openai`    the OpenAI wire format: request models, error shapes,
  response builders, server-sent events

It imports none of ``proxy``, ``engine``, ``billing``, ``web`` or ``migrations``;
they import it (``tests/test_architecture.py`` holds the directions).
"""
