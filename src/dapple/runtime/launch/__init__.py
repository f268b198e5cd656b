"""Starting a run's processes and ending them: ``launcher`` starts the workers standalone or
joins a ``torchrun`` group and waits for them; ``local`` binds a worker's life to its launcher's
(heartbeats, stop signals, a loopback-only rendezvous); ``early`` starts the workers before the
run is known; ``elastic`` re-plans for the devices left after a lost one; ``failure`` words a
rank's failure (one line, then the schedule grid) and ``stop_line`` a stopped run's last line."""
