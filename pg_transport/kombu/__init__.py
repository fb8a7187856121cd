"""kombu's shapes on the pgq engine: the transport, its channel and QoS, a producer's
batch, the worker's delivery guard, and every Celery signal pgq connects (hooks)."""
