"""Jobs that restart themselves under Paddle's elastic launcher: each start is an attempt of the job
(``job``), and ``python -m ernie_moe.elastic`` runs the launcher with what it needs (``launch``)."""
