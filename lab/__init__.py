"""The project's lab: studies and probes behind the results page
(docs/results.md), run from a checkout (``python -m lab NAME``; see
lab/README.md).  Not part of the installed package: it imports
``gtopk_plugin``, never the other way round."""
