"""Adapters for foreign trainers (accelerate, the HF Trainer, torchtitan).

Nothing inside the library imports this package, and each adapter imports its trainer only
when used: ``from fsdp_ext.integrations.accelerate import prepare``.
"""
