"""Speculators propose draft tokens; the engine verifies them losslessly (specdec/verify.py)."""

from specdec.speculate.config import SpecConfig, add_spec_args, spec_config_from_args

__all__ = ["SpecConfig", "add_spec_args", "spec_config_from_args"]
