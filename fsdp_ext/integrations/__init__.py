"""Adapters for foreign trainers (accelerate, the HF Trainer, torchtitan).

Nothing inside the library imports this package, and each adapter imports its trainer only
when used: ``from fsdp_ext.integrations.accelerate import prepare``. The adapters are its
public modules (``accelerate``, ``hf_trainer``, ``torchtitan``); this package re-exports
nothing, so importing it never imports a trainer.
"""

__all__: list[str] = []
