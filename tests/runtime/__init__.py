"""A package, so that its test modules may share a basename with a suite's (pytest's default
import mode names a module by its basename outside packages): ``test_selective.py`` here tests
``fxckpt/runtime/selective.py``, ``tests/test_selective.py`` selective plans end to end."""
