import { MigrationInterface, QueryRunner } from 'typeorm';
import { ALLOCATE_EACH, ALLOCATE_FUNCTION_V1, ALLOCATE_SIGNATURE, ALLOCATE_VARIABLES } from './1764100000000-AllocateFunction.js';

/**
 * `respool_allocate` first tries the whole batch at once: one statement for each of steps 2-5 (see
 * AllocateFunction) over every commit of the batch, in one subtransaction. When every commit would land,
 * which is the usual case, that is all, and it costs Postgres about half of what the commits one by one
 * did (one statement per row, one subtransaction per commit). When any step fails for any commit (a stale
 * generation, an epoch already ended, a version moved on, a reservation committed before, or the same
 * item or epoch twice in the batch), the subtransaction is rolled back, nothing of it stays, and the
 * commits run one by one exactly as before, each landing or failing on its own.
 *
 * The all-at-once path checks what the one-by-one path checks: every update is still the version-checked
 * `UPDATE ... WHERE id = ? AND pool_id = ? AND state = 1 AND version = ?` of one item (joined by primary
 * key), and it counts the rows it changed: one fewer than the items asked for rolls the attempt back.
 */
export class AllocateAllAtOnce1764200000000 implements MigrationInterface {
  name = 'AllocateAllAtOnce1764200000000';

  async up(q: QueryRunner): Promise<void> {
    await q.query(`
      CREATE OR REPLACE FUNCTION ${ALLOCATE_SIGNATURE} AS $fn$
      DECLARE
${ALLOCATE_VARIABLES}
        changed bigint;
        item_pools bigint[];
        item_owners text[];
        item_reservations text[];
        firsts integer[];
      BEGIN
        PERFORM pg_advisory_xact_lock_shared(p_generation_lock);
        -- Per item: its commit's pool, owner and reservation; per commit: where its items start.
        FOR e IN 1 .. cardinality(p_reservations) LOOP
          firsts[e] := first;
          FOR i IN first .. first + p_counts[e] - 1 LOOP
            item_pools[i] := p_pools[e];
            item_owners[i] := p_owners[e];
            item_reservations[i] := p_reservations[e];
          END LOOP;
          first := first + p_counts[e];
        END LOOP;
        BEGIN
          IF EXISTS (SELECT 1 FROM unnest(p_generations) AS g (gen) WHERE NOT EXISTS (SELECT 1 FROM t_redis_generation r WHERE r.gen = g.gen)) THEN
            RAISE EXCEPTION 'a Redis generation of the batch is no longer current' USING ERRCODE = 'RP409';
          END IF;
          INSERT INTO t_commit_decision (reservation_id, epoch, decision)
          SELECT rid, epoch, 'commit' FROM unnest(p_reservations, p_epochs) AS d (rid, epoch);
          WITH allocated AS (
            UPDATE t_resource r SET state = 2, version = r.version + 1, owner = x.owner, update_time = now()
              FROM unnest(p_ids, p_versions, item_pools, item_owners, item_reservations) AS x (id, version, pool_id, owner, rid)
             WHERE r.id = x.id AND r.pool_id = x.pool_id AND r.state = 1 AND r.version = x.version
            RETURNING r.id, r.pool_id, r.version, x.owner, x.rid
          )
          INSERT INTO t_allocation_history (resource_id, pool_id, action, owner, reservation_id, version)
          SELECT id, pool_id, 'allocate', owner, rid, version FROM allocated;
          GET DIAGNOSTICS changed = ROW_COUNT;
          IF changed <> cardinality(p_ids) THEN
            RAISE EXCEPTION 'a version check of the batch failed' USING ERRCODE = 'RP409';
          END IF;
          INSERT INTO t_commit (reservation_id, pool_id, owner, resource_ids, body)
          SELECT p_reservations[e], p_pools[e], p_owners[e], p_ids[firsts[e] : firsts[e] + p_counts[e] - 1], p_bodies[e]
            FROM generate_subscripts(p_reservations, 1) AS e;
          RETURN array_fill('committed'::text, ARRAY[cardinality(p_reservations)]);
        EXCEPTION
          WHEN SQLSTATE 'RP409' OR unique_violation THEN
            NULL; -- rolled back: one by one below
        END;
        first := 1;
${ALLOCATE_EACH}
        RETURN results;
      END
      $fn$`);
  }

  async down(q: QueryRunner): Promise<void> {
    await q.query(ALLOCATE_FUNCTION_V1.replace('CREATE FUNCTION', 'CREATE OR REPLACE FUNCTION'));
  }
}
