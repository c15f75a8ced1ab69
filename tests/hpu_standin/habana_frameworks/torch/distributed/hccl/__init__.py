"""STAND-IN: importing it records that the hccl backend was requested."""
from habana_frameworks import record

record("import_hccl")
