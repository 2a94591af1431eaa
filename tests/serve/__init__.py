"""A package, so that its test modules may share a basename with a suite's (pytest's default
import mode names a module by its basename outside packages): ``test_sizes.py`` here tests
``fxckpt/serve/sizes.py``, ``tests/dynamo/test_sizes.py`` the Dynamo path's sizes."""
