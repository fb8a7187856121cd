from celery.contrib.testing.worker import start_worker
from tasks import add, app


def test_the_projects_own_app_runs_on_pgq(pgq_use):
    pgq_use(app)
    with start_worker(app, pool="threads", perform_ping_check=False):
        assert add.delay(2, 3).get(timeout=30) == 5


def test_a_task_defined_in_the_test(pgq_app, pgq_worker):
    @pgq_app.task
    def mul(x, y):
        return x * y

    pgq_worker.reload()
    assert mul.delay(6, 7).get(timeout=30) == 42


def test_each_test_has_a_schema_of_its_own(pgq_app, pgq_schema):
    assert pgq_app.conf.broker_transport_options["schema"] == pgq_schema


def test_celerys_own_fixtures_on_pgq(celery_app, celery_worker):
    @celery_app.task
    def hello():
        return "hi"

    celery_worker.reload()
    assert hello.delay().get(timeout=30) == "hi"
    assert celery_app.conf.broker_url.startswith("pgq://")
