"""The ``kvtoll`` command line: the root (:mod:`kvtoll.cli.main`) and its errors."""
