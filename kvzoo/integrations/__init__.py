"""Adapters that let other runtimes keep their KV cache in kvzoo.

- `kvzoo.integrations.transformers`: a Hugging Face transformers `Cache` whose layers live in
  kvzoo's paged cache, and the `"kvzoo_paged"` attention function that reads it
  (`pip install "kvzoo[transformers]"`).

Each adapter imports its runtime when it is imported, never from `import kvzoo`.
"""
