"""The scheduler, split by job.

* ``scheduler``: the loop (``Scheduler.schedule``: token budget, running requests, preemption)
  and the step as data;
* ``admission``: waiting -> running (prefix-cache and KV connector look-up, check-then-commit
  block allocation with one retry);
* ``update``: ``Scheduler.update_from_output`` (new tokens, stops, draft rollback);
* ``remote_kv``: ``RemoteKVTracker``, requests in KV transfer between engines (P/D);
* ``waiting_queue``: FCFS or priority order of waiting requests;
* ``spec_policy``: dynamic speculation (how many drafts to verify per step).
"""

from kvserve.core.scheduler.scheduler import RequestUpdate, Scheduler, SchedulerStats

__all__ = ["Scheduler", "SchedulerStats", "RequestUpdate"]
