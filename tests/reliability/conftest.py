"""Reliability and security tests (issue 6) reuse the service tests' tiny checkpoints and adapters.

The fixtures are imported from tests/service/conftest.py (not copied), so a switch there to other
checkpoints reaches these tests too.
"""

from tests.service.conftest import adapters_dir, models_dir, tiny_root  # noqa: F401
