"""A run's life cycle: building it (``runtime``, ``async_runtime``), the bundle the loop uses (``components``), the
run directory and its lock (``directory``, ``lock``) and the checkpoint it starts from (``restore``)."""
