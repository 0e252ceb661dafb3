"""The routing simulator: Mooncake traces replayed through a simulated fleet behind the
live router (``kvtoll bench routing``, bench/routing_policies.py)."""
