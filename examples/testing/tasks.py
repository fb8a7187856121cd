from celery import Celery

# The project's real configuration; the tests point the app at pgq (pgq_use).
app = Celery("proj", broker="redis://cache.internal:6379/0")


@app.task
def add(x, y):
    return x + y
