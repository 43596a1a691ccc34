"""Reports of a validation run.

* :mod:`oracle.report.run_report` -- :class:`Report`: a run's results, coverage and grades;
* :mod:`oracle.report.formats` -- text, JSON, JUnit XML and HTML;
* :mod:`oracle.report.summary` -- verdict counts, collapsed unsupported cases, worst failures.
"""
