"""The semantic cache's pair benchmark (``kvtoll bench semantic``) and its precision views."""
