"""What a row and its headers mean: the claimed row (rows), ordering headers, topic
bindings, the ETA, the task identity registry, what Celery reads of a task message
(protocol), what a payload must be before kombu is given it (envelope) and the decoding
of a poisoned message (poison). No SQL, no kombu, no Celery: the consumer, the
publisher and the store use these; these use none of them."""
