"""Tests of ``fxckpt/serve/dynamo/``, module by module (the Dynamo suite end to end is
``tests/dynamo/``); a package for the reason ``tests/serve/__init__.py`` gives."""
