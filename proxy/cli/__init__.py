"""The ``kvtoll`` command line."""
