import pytest

pytest_plugins = ["pg_transport.testing", "celery.contrib.pytest"]


@pytest.fixture
def celery_config(pgq_celery_config):
    return pgq_celery_config
