"""sacct sync and the cost, queue-wait, failure and efficiency reports."""
