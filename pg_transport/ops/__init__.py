"""Operating pgq: the `pgq` command and what it reports and does (status, metrics, dead
letters, the demo). Built on the store; nothing here runs inside a worker."""
