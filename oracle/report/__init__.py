"""Reports of a validation run.

* :mod:`oracle.report.formats` -- text, JSON, JUnit XML and HTML;
* :mod:`oracle.report.summary` -- verdict counts, collapsed unsupported cases, worst failures.
"""
