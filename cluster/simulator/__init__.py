"""Cluster-scale simulator and capacity planner ("how many GPUs of each kind").

``hardware`` (device presets), ``cost_model`` (model shape, roofline, calibration),
``workload`` (traces and arrival patterns), ``cluster_model`` (replicas, router, run config),
``simulation`` (the discrete-event loop, driving the real ``cluster.planner.Planner``),
``search`` (``pdcluster plan``), ``report`` (text and PNG), ``cli`` (``plan``, ``simulate``).
"""
