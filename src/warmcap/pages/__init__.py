"""Self-contained HTML pages of start-up: the warmup plan's block layouts, the capture report and a
report diff. Each page is built from the same data as the JSON output (``WarmupPlan.to_json()``,
``CaptureReport.to_dict()``) and carries its own CSS, SVG and script: no network, opens from disk.
"""
