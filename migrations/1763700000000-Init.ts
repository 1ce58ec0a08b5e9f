import { MigrationInterface, QueryRunner } from 'typeorm';

export class Init1763700000000 implements MigrationInterface {
  name = 'Init1763700000000';

  async up(q: QueryRunner): Promise<void> {
    await q.query(`
      CREATE TABLE t_pool (
        id                  bigserial PRIMARY KEY,
        name                text NOT NULL UNIQUE CHECK (name ~ '^[a-z0-9][a-z0-9_-]{0,62}$'),
        kind                text NOT NULL CHECK (kind IN ('number', 'task')),
        hold_ttl_ms         integer NOT NULL CHECK (hold_ttl_ms >= 1000),
        max_hold_ttl_ms     integer NOT NULL CHECK (max_hold_ttl_ms >= hold_ttl_ms),
        max_holds_per_owner integer CHECK (max_holds_per_owner >= 1),
        created_at          timestamptz NOT NULL DEFAULT now()
      )`);
    await q.query(`
      CREATE TABLE t_resource (
        id          bigserial PRIMARY KEY,
        pool_id     bigint NOT NULL REFERENCES t_pool (id),
        value       varchar(256) NOT NULL,
        state       smallint NOT NULL DEFAULT 1 CHECK (state IN (1, 2)),
        version     integer NOT NULL DEFAULT 0,
        owner       text,
        group_key   text,
        attributes  jsonb NOT NULL DEFAULT '{}'::jsonb,
        add_time    timestamptz NOT NULL DEFAULT now(),
        update_time timestamptz NOT NULL DEFAULT now(),
        CONSTRAINT t_resource_owner_when_allocated CHECK ((state = 2) = (owner IS NOT NULL))
      )`);
    await q.query(`CREATE UNIQUE INDEX t_resource_pool_value_key ON t_resource (pool_id, value)`);
    await q.query(`CREATE INDEX t_resource_pool_state_idx ON t_resource (pool_id, state)`);
    await q.query(`
      CREATE TABLE t_allocation_history (
        id             bigserial PRIMARY KEY,
        resource_id    bigint NOT NULL REFERENCES t_resource (id),
        pool_id        bigint NOT NULL REFERENCES t_pool (id),
        action         text NOT NULL CHECK (action IN ('allocate', 'release')),
        owner          text NOT NULL,
        reservation_id text,
        version        integer NOT NULL,
        created_at     timestamptz NOT NULL DEFAULT now()
      )`);
    await q.query(`CREATE INDEX t_allocation_history_resource_idx ON t_allocation_history (resource_id, id)`);
    await q.query(`
      CREATE TABLE t_commit (
        reservation_id text PRIMARY KEY,
        pool_id        bigint NOT NULL REFERENCES t_pool (id),
        owner          text NOT NULL,
        resource_ids   bigint[] NOT NULL,
        body           jsonb NOT NULL,
        created_at     timestamptz NOT NULL DEFAULT now()
      )`);
    await q.query(`
      CREATE TABLE t_job_mutex (
        job_type    text PRIMARY KEY,
        version     bigint NOT NULL DEFAULT 0,
        holder      text,
        update_time timestamptz NOT NULL DEFAULT now()
      )`);
    await q.query(`INSERT INTO t_job_mutex (job_type) VALUES ('rebuild')`);
  }

  async down(q: QueryRunner): Promise<void> {
    await q.query(`DROP TABLE t_job_mutex`);
    await q.query(`DROP TABLE t_commit`);
    await q.query(`DROP TABLE t_allocation_history`);
    await q.query(`DROP TABLE t_resource`);
    await q.query(`DROP TABLE t_pool`);
  }
}
