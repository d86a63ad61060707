"""The property suite that ships with refengine: `pytest --pyargs refengine.suite [--engine-url URL]`.

harness.py holds what the properties share; each test_*.py is one property family; plugin.py is the
pytest plugin (markers, Hypothesis profiles, options, fixtures) every installation registers."""
