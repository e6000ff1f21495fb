"""Format readers, arrival processes and generators behind :mod:`envs.serving.workload`.

Import the public API from :mod:`envs.serving.workload`; the modules here are its parts:
``trace`` (the :class:`Trace` a workload hands out), ``spec`` (the YAML/Hydra schema),
``files`` (Azure, Mooncake and length-only readers), ``timed`` and ``lengths`` (splits and
windows of those files), ``servegen`` (ServeGen rate windows to requests), ``synthetic``
(the Azure-conv fit) and ``renewal`` (seeded arrival processes).
"""
