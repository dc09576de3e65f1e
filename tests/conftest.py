import os

# Keep test runs off the user's cache and make every process of a test see the same cache.
os.environ.setdefault("AGORA_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "agora-test"))
os.environ.setdefault("USE_LEGACY_BFLOAT16", "0")
