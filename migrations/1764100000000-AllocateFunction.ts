import { MigrationInterface, QueryRunner } from 'typeorm';

/** The function's signature, shared by every version of it (`CREATE OR REPLACE` keeps the signature). */
export const ALLOCATE_SIGNATURE = `respool_allocate(p_pools bigint[], p_reservations text[], p_epochs integer[], p_generations bigint[],
                                       p_owners text[], p_bodies jsonb[], p_counts integer[], p_ids bigint[],
                                       p_versions integer[], p_generation_lock bigint)
      RETURNS text[] LANGUAGE plpgsql VOLATILE`;

/** Steps 2-5 for each commit of the batch, in its own subtransaction; uses ALLOCATE_VARIABLES. */
export const ALLOCATE_EACH = `        FOR e IN 1 .. cardinality(p_reservations) LOOP
          BEGIN
            IF NOT EXISTS (SELECT 1 FROM t_redis_generation WHERE gen = p_generations[e]) THEN
              RAISE EXCEPTION 'the Redis generation % is no longer current', p_generations[e] USING ERRCODE = 'RP409';
            END IF;
            INSERT INTO t_commit_decision (reservation_id, epoch, decision) VALUES (p_reservations[e], p_epochs[e], 'commit');
            FOR i IN first .. first + p_counts[e] - 1 LOOP
              UPDATE t_resource SET state = 2, version = version + 1, owner = p_owners[e], update_time = now()
               WHERE id = p_ids[i] AND pool_id = p_pools[e] AND state = 1 AND version = p_versions[i]
              RETURNING version INTO allocated_version;
              IF NOT FOUND THEN
                RAISE EXCEPTION 'the version check failed for resource %', p_ids[i] USING ERRCODE = 'RP409';
              END IF;
              INSERT INTO t_allocation_history (resource_id, pool_id, action, owner, reservation_id, version)
              VALUES (p_ids[i], p_pools[e], 'allocate', p_owners[e], p_reservations[e], allocated_version);
            END LOOP;
            INSERT INTO t_commit (reservation_id, pool_id, owner, resource_ids, body)
            VALUES (p_reservations[e], p_pools[e], p_owners[e], p_ids[first : first + p_counts[e] - 1], p_bodies[e]);
            results := results || 'committed'::text;
          EXCEPTION
            WHEN SQLSTATE 'RP409' THEN
              results := results || 'conflict'::text;
            WHEN unique_violation THEN
              GET STACKED DIAGNOSTICS violated = CONSTRAINT_NAME;
              results := results || (CASE WHEN violated = 't_commit_pkey' THEN 'duplicate' ELSE 'decided' END);
          END;
          first := first + p_counts[e];
        END LOOP;`;

/** The variables ALLOCATE_EACH uses, declared by every version of the function. */
export const ALLOCATE_VARIABLES = `        results text[] := '{}';
        first integer := 1;
        allocated_version integer;
        violated text;`;

export const ALLOCATE_FUNCTION_V1 = `
      CREATE FUNCTION ${ALLOCATE_SIGNATURE} AS $fn$
      DECLARE
${ALLOCATE_VARIABLES}
      BEGIN
        PERFORM pg_advisory_xact_lock_shared(p_generation_lock);
${ALLOCATE_EACH}
        RETURN results;
      END
      $fn$`;

/**
 * The commits of confirms as one server-side function that takes a batch of them: one round trip and one
 * transaction (one WAL flush) for every confirm that arrived while the previous batches were in flight.
 * Each commit of the batch runs in its own subtransaction, so it lands or fails on its own; the function
 * returns one result per commit.
 *
 * Per commit, in this order (as in the single transaction it replaces):
 * 1. (once per batch) the generation lock, shared: a bump of the Redis generation takes it exclusively
 *    and waits for us; a VOLATILE function takes a fresh snapshot for each statement, so the statements
 *    after it see a bump that committed while we waited;
 * 2. the Redis generation the holds were taken in must still be current, else 'conflict';
 * 3. the commit epoch's decision, 'commit': a unique violation on t_commit_decision_pkey means the epoch
 *    was already ended (a concurrent confirm of the same reservation, or the sweeper's abort): 'decided';
 * 4. the version-checked UPDATE of every item, by primary key, in the caller's (sorted) order, with a
 *    history row each; an item whose state or version moved on: 'conflict';
 * 5. the commit record: a unique violation on t_commit_pkey means the reservation was committed before:
 *    'duplicate'. Otherwise 'committed'.
 */
export class AllocateFunction1764100000000 implements MigrationInterface {
  name = 'AllocateFunction1764100000000';

  async up(q: QueryRunner): Promise<void> {
    await q.query(ALLOCATE_FUNCTION_V1);
  }

  async down(q: QueryRunner): Promise<void> {
    await q.query(
      `DROP FUNCTION respool_allocate(bigint[], text[], integer[], bigint[], text[], jsonb[], integer[], bigint[], integer[], bigint)`,
    );
  }
}
