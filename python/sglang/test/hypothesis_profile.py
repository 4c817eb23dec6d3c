"""A pytest plugin (``-p sglang.test.hypothesis_profile``) that ``test/run_suite.py`` loads
whenever it passes a ``--hypothesis-seed``.

Hypothesis loads its built-in ``ci`` profile when it sees a CI environment, and that profile
derandomizes: every seed then draws the same examples, so the seed a run prints could not
replay anything. This keeps whatever profile is active (the ``ci`` one's deadline and health
checks included) but turns derandomizing off, so the run's seed decides the examples. Tests
that set ``derandomize=True`` themselves keep it.
"""

from hypothesis import settings

settings.register_profile("sglang-seeded", parent=settings.default, derandomize=False)
settings.load_profile("sglang-seeded")
