#!/bin/sh
# pgq's roles and schema, and who may connect: blocks 1 and 2 of docs/least-privilege.md,
# as the superuser. The postgres image runs this once, when it creates the database (an
# empty data volume); the passwords come from the postgres service's environment.
# tests/unit/test_compose.py checks the statements are the page's; tests/acceptance/
# test_compose.py runs this script.
set -eu
psql -v ON_ERROR_STOP=1 --no-psqlrc --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
    --set owner_password="$OWNER_PASSWORD" \
    --set worker_password="$WORKER_PASSWORD" \
    --set publisher_password="$PUBLISHER_PASSWORD" \
    --set monitor_password="$MONITOR_PASSWORD" <<'SQL'
-- 1. roles and schema, as a superuser
CREATE ROLE pgq_owner LOGIN PASSWORD :'owner_password';
CREATE ROLE pgq_worker LOGIN PASSWORD :'worker_password';
CREATE ROLE pgq_publisher LOGIN PASSWORD :'publisher_password';
CREATE ROLE pgq_monitor LOGIN PASSWORD :'monitor_password';
CREATE SCHEMA pgq AUTHORIZATION pgq_owner;
GRANT pg_read_all_stats TO pgq_monitor;
ALTER ROLE pgq_worker SET search_path = pg_catalog, pg_temp;
ALTER ROLE pgq_publisher SET search_path = pg_catalog, pg_temp;
ALTER ROLE pgq_monitor SET search_path = pg_catalog, pg_temp;

-- 2. who may connect, as a superuser
REVOKE CONNECT, TEMPORARY ON DATABASE :"DBNAME" FROM PUBLIC;
GRANT CONNECT ON DATABASE :"DBNAME" TO pgq_owner, pgq_worker, pgq_publisher, pgq_monitor;
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
SQL
