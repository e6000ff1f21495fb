"""The operator's advisor behind ``python advise.py``: traffic and SLO targets in, engine flags out.

Each part has one job: :mod:`advisor.targets` (the SLO in operators' terms and when it holds),
:mod:`advisor.engines` (the serving engine's knobs, defaults and flags), :mod:`advisor.traffic`
(a trace, a named workload or a vLLM ``/metrics`` scrape as one workload), :mod:`advisor.search`
(every candidate's capacity, fast or as the reference), :mod:`advisor.topology` (colocated
serving against prefill-decode splits of the same servers), :mod:`advisor.diagnosis` (is there
head-of-line blocking, and does chunking cure it) and :mod:`advisor.report` (advice.md,
advice.json and the plots).
"""
