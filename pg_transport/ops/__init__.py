"""Operating pgq: the `pgq` command and what it reports and does (status, metrics, dead
letters, health, the demo). Built on the store; of all this only health's heartbeat step
runs inside a worker (it is what `pgq health` reads)."""
