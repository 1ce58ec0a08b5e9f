import { Injectable } from '@nestjs/common';
import type { Pool as PgPool } from 'pg';
import { DataSource } from 'typeorm';
import type { PostgresDriver } from 'typeorm/driver/postgres/PostgresDriver.js';
import { AppConfig } from '../config/app-config.js';
import { Batcher } from './batcher.js';
import { MAX_BATCHES_IN_FLIGHT, MAX_COMMITS_PER_BATCH } from './commit-batches.js';
import { GENERATION_LOCK } from './generation.repository.js';
import { pg } from './postgres.js';
import { sqlStateOf } from '../common/dependency-errors.js';

export interface ResourceRow {
  id: string;
  value: string;
  state: number;
  version: number;
  owner: string | null;
  groupKey: string | null;
  attributes: Record<string, string>;
  updatedAt: Date;
}

export interface NewResource {
  value: string;
  attributes: Record<string, string>;
  groupKey: string | null;
}

export interface Allocation {
  poolId: string;
  owner: string;
  reservationId: string;
  /** The reservation's commit epoch: Postgres records that this epoch ended in a commit. */
  epoch: number;
  /** The Redis generation the holds were taken in: the commit lands only if it is still current. */
  generation: number;
  /** The items to allocate, each with the version the hold was taken at (the fencing token). */
  items: { id: string; version: number }[];
  /** The confirm/complete answer as JSON text, stored so that retries get the same body. */
  body: string;
}

/**
 * `committed`: allocated now. `conflict`: a version check failed, nothing changed. `duplicate`: this
 * reservation was committed before. `decided`: this commit epoch was already ended (committed by a
 * concurrent confirm, or given up by the sweeper); nothing changed.
 */
export type AllocationResult = 'committed' | 'conflict' | 'duplicate' | 'decided';

const ROW = `id::text AS id, value, state, version, owner, group_key AS "groupKey", attributes, update_time AS "updatedAt"`;

/**
 * SQL, of a row of t_resource that is allocated: its allocation is a task lease's completion (the commit of its last
 * allocation records the kind "l"). A commit recorded before commits kept their kind is taken for a reservation's.
 */
const ALLOCATED_BY_LEASE = `EXISTS (
  SELECT 1 FROM t_commit c
   WHERE c.body->>'kind' = 'l'
     AND c.reservation_id = (SELECT h.reservation_id FROM t_allocation_history h
                              WHERE h.resource_id = t_resource.id AND h.action = 'allocate' ORDER BY h.id DESC LIMIT 1))`;

@Injectable()
export class ResourceRepository {
  private readonly commits: Batcher<Allocation, AllocationResult>;

  constructor(
    private readonly db: DataSource,
    config: AppConfig,
  ) {
    // At most half the pool for commit batches, so reads and the sweeper always find a connection.
    const batches = Math.max(1, Math.min(MAX_BATCHES_IN_FLIGHT, Math.floor(config.DB_POOL_SIZE / 2)));
    // A commit that cannot even start within the statement timeout answers 503, like one that timed out.
    this.commits = new Batcher((batch) => this.allocateBatch(batch), batches, MAX_COMMITS_PER_BATCH, config.DB_TIMEOUT_MS);
  }

  /**
   * Bulk insert; values already in the pool are skipped. Returns the id and value of each row inserted
   * (free, at version 0, with the attributes and group it was given). The values must be distinct.
   */
  insertMany(poolId: string, items: NewResource[]): Promise<{ id: string; value: string }[]> {
    // In one order of values for every import: two imports of the same new values then wait on each other's
    // index entries in that order, one after the other, where in opposite orders Postgres ends one of them
    // as a deadlock. (A deadlock still met, with another writer of the table, is run again: nothing of it
    // was written.)
    const sorted = [...items].sort((x, y) => (x.value < y.value ? -1 : x.value > y.value ? 1 : 0));
    const params = [poolId, sorted.map((i) => i.value), sorted.map((i) => JSON.stringify(i.attributes)), sorted.map((i) => i.groupKey)];
    const insert = (skipExisting: boolean): Promise<{ id: string; value: string }[]> =>
      this.db.query(
        `INSERT INTO t_resource (pool_id, value, attributes, group_key)
         SELECT $1, v, a, g FROM unnest($2::varchar[], $3::jsonb[], $4::text[]) AS i(v, a, g)
         ${skipExisting ? 'ON CONFLICT (pool_id, value) DO NOTHING' : ''}
         RETURNING id::text AS id, value`,
        params,
      );
    // New values, the usual case, first with a plain INSERT: ON CONFLICT's speculative insertion costs Postgres
    // about a fifth more a row. A value already in the pool (a retried import) makes it fail whole, and the rows
    // go in again skipping the values already there. The failed statement commits nothing, but it leaves dead
    // tuples and used ids for the rows it wrote before the conflict (the values are sorted: a retried chunk fails
    // on its first row).
    const run = (skipExisting: boolean): Promise<{ id: string; value: string }[]> =>
      insert(skipExisting).catch((err: unknown) => {
        if (sqlStateOf(err) === '23505' && !skipExisting) return run(true);
        if (sqlStateOf(err) === '40P01') return insert(true);
        return Promise.reject(err);
      });
    return pg(() => run(false));
  }

  async findById(poolId: string, id: string): Promise<ResourceRow | null> {
    const rows: ResourceRow[] = await pg(() => this.db.query(`SELECT ${ROW} FROM t_resource WHERE pool_id = $1 AND id = $2`, [poolId, id]));
    return rows[0] ?? null;
  }

  /** The free rows of the pool with these values. */
  findFreeByValues(poolId: string, values: string[]): Promise<ResourceRow[]> {
    return pg(() =>
      this.db.query(`SELECT ${ROW} FROM t_resource WHERE pool_id = $1 AND value = ANY($2::varchar[]) AND state = 1`, [poolId, values]),
    );
  }

  findMany(poolId: string, ids: string[]): Promise<ResourceRow[]> {
    return pg(() => this.db.query(`SELECT ${ROW} FROM t_resource WHERE pool_id = $1 AND id = ANY($2::bigint[])`, [poolId, ids]));
  }

  /**
   * The commit of DESIGN.md: one transaction with the version-checked
   * `UPDATE ... WHERE id = ? AND state = 1 AND version = ?` for every item, a history row for each, the
   * epoch's decision and the commit record. All or nothing for this reservation. Commits that arrive
   * together share one call of the `respool_allocate` function (migration AllocateFunction): one round
   * trip and one transaction for the batch: one statement per step for every commit of the batch when
   * they all land (migration AllocateAllAtOnce), else each commit in its own subtransaction.
   */
  allocate(a: Allocation): Promise<AllocationResult> {
    return pg(() => this.commits.submit(a));
  }

  private async allocateBatch(batch: Allocation[]): Promise<(AllocationResult | Error)[]> {
    // One order for every batch: two batches then meet each other's rows in the same order.
    const order = batch.map((a, i) => ({ a, i })).sort((x, y) => (x.a.reservationId < y.a.reservationId ? -1 : 1));
    try {
      const results = await this.callAllocate(order.map((o) => o.a));
      const answers: AllocationResult[] = new Array<AllocationResult>(batch.length);
      order.forEach((o, k) => (answers[o.i] = results[k]));
      return answers;
    } catch (err) {
      // Two batches can still deadlock on rows of stale holds; Postgres aborts one: run its commits alone,
      // one after the other (a deadlock of one of those is a 503: nothing was changed).
      if (sqlStateOf(err) !== '40P01' || batch.length === 1) throw err;
      const answers: (AllocationResult | Error)[] = [];
      for (const a of batch) {
        answers.push(
          await this.callAllocate([a]).then(
            (r): AllocationResult | Error => r[0],
            (e: Error) => e,
          ),
        );
      }
      return answers;
    }
  }

  /** One call of `respool_allocate` for these commits, in this order: one result each. */
  async callAllocate(batch: Allocation[]): Promise<AllocationResult[]> {
    const pool = (this.db.driver as PostgresDriver).master as PgPool;
    const { rows } = await pool.query<{ results: AllocationResult[] }>({
      name: 'respool_allocate',
      // The commit records go as one JSON array, not as a Postgres array of JSON texts: pg would quote and
      // escape every character of each record on the way (the confirm's profile showed that work).
      text: `SELECT respool_allocate($1, $2, $3, $4, $5,
               ARRAY(SELECT body FROM jsonb_array_elements($6::jsonb) WITH ORDINALITY AS b(body, n) ORDER BY n),
               $7, $8, $9, $10) AS results`,
      values: [
        batch.map((a) => a.poolId),
        batch.map((a) => a.reservationId),
        batch.map((a) => a.epoch),
        batch.map((a) => a.generation),
        batch.map((a) => a.owner),
        `[${batch.map((a) => a.body).join(',')}]`,
        batch.map((a) => a.items.length),
        batch.flatMap((a) => a.items.map((i) => i.id)),
        batch.flatMap((a) => a.items.map((i) => i.version)),
        GENERATION_LOCK,
      ],
    });
    return rows[0].results;
  }

  /**
   * Records that the reservation's commit epochs up to `epoch` are given up, except those whose commit
   * got there first (each insert waits for a commit in flight): an earlier epoch's commit may still be
   * in flight after its caller gave up on it. Returns 'commit' if any of them committed.
   */
  async decideAbort(reservationId: string, epoch: number): Promise<'commit' | 'abort'> {
    return pg(async () => {
      await this.db.query(
        `INSERT INTO t_commit_decision (reservation_id, epoch, decision)
         SELECT $1, e, 'abort' FROM generate_series(1, $2::int) AS e
         ON CONFLICT (reservation_id, epoch) DO NOTHING`,
        [reservationId, epoch],
      );
      // A new statement, so a new snapshot: it sees the rows whose commits the insert waited for.
      const rows: { committed: boolean }[] = await this.db.query(
        `SELECT coalesce(bool_or(decision = 'commit'), false) AS committed FROM t_commit_decision
          WHERE reservation_id = $1 AND epoch <= $2`,
        [reservationId, epoch],
      );
      return rows[0].committed ? 'commit' : 'abort';
    });
  }

  /** What Postgres recorded for one commit epoch of the reservation, if anything yet (it writes nothing). */
  async decisionOf(reservationId: string, epoch: number): Promise<'commit' | 'abort' | null> {
    const rows: { decision: 'commit' | 'abort' }[] = await pg(() =>
      this.db.query(`SELECT decision FROM t_commit_decision WHERE reservation_id = $1 AND epoch = $2`, [reservationId, epoch]),
    );
    return rows[0]?.decision ?? null;
  }

  /**
   * allocated -> free for this owner, version incremented, history row written. Null if not allocated to that owner.
   * `leases`: false when an item a task lease's completion allocated is not to be released (it is then null too): the
   * caller acts for an owner, and owners and reviewers share one space of names.
   */
  async release(poolId: string, id: string, owner: string, leases = true): Promise<ResourceRow | null> {
    const rows: ResourceRow[] = await pg(() =>
      this.db.query(
        `WITH upd AS (
           UPDATE t_resource SET state = 1, version = version + 1, owner = NULL, update_time = now()
            WHERE pool_id = $1 AND id = $2 AND state = 2 AND owner = $3
              AND ($4 OR NOT ${ALLOCATED_BY_LEASE})
           RETURNING *
         ), hist AS (
           INSERT INTO t_allocation_history (resource_id, pool_id, action, owner, version)
           SELECT id, pool_id, 'release', $3, version FROM upd
         )
         SELECT ${ROW} FROM upd`,
        [poolId, id, owner, leases],
      ),
    );
    return rows[0] ?? null;
  }

  /** Whether the allocated item `id` of the pool was allocated by a task lease's completion. */
  async allocatedByLease(poolId: string, id: string): Promise<boolean> {
    const rows: { lease: boolean }[] = await pg(() =>
      this.db.query(`SELECT ${ALLOCATED_BY_LEASE} AS lease FROM t_resource WHERE pool_id = $1 AND id = $2 AND state = 2`, [poolId, id]),
    );
    return rows[0]?.lease === true;
  }

  /**
   * One page of the pool's free rows, in id order, for the rebuild of the free index. In numeric order:
   * a bare `ORDER BY id` would sort by ROW's `id::text` (an output name wins there), and the next page,
   * after the last id of a page in text order, would skip every smaller id that sorts after it as text.
   */
  freePage(poolId: string, afterId: string, limit: number): Promise<ResourceRow[]> {
    return pg(() =>
      this.db.query(`SELECT ${ROW} FROM t_resource WHERE pool_id = $1 AND state = 1 AND id > $2 ORDER BY t_resource.id LIMIT $3`, [
        poolId,
        afterId,
        limit,
      ]),
    );
  }
}
