"""Containerised pipeline steps. Each step is run as ``python -m steps.<name>``.

Steps never import from ``workflows/``; the small shared modules they need live here:
``errors`` (one-line failures), ``artifacts`` (MANIFEST.json and atomic publishing) and
``storage`` (everything that touches S3).
"""

__version__ = "0.1.0"
