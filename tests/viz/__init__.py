"""A package, so that its test modules may share a basename with another test file (pytest's
default import mode names a module by its basename outside packages): ``test_layout.py`` here
tests ``fxckpt/viz/layout.py``, ``tests/test_layout.py`` the layout of the tests themselves."""
