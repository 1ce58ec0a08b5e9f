import { Injectable } from '@nestjs/common';
import { DataSource } from 'typeorm';
import { GENERATION_LOCK } from './generation.repository.js';
import { pg, sqlState } from './postgres.js';

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
  /** The confirm/complete answer, stored so that retries get the same body. */
  body: Record<string, unknown>;
}

/**
 * `committed`: allocated now. `conflict`: a version check failed, nothing changed. `duplicate`: this
 * reservation was committed before. `decided`: this commit epoch was already ended (committed by a
 * concurrent confirm, or given up by the sweeper); nothing changed.
 */
export type AllocationResult = 'committed' | 'conflict' | 'duplicate' | 'decided';

const ROW = `id::text AS id, value, state, version, owner, group_key AS "groupKey", attributes, update_time AS "updatedAt"`;

@Injectable()
export class ResourceRepository {
  constructor(private readonly db: DataSource) {}

  /** Bulk insert; values already in the pool are skipped. Returns the rows inserted. */
  insertMany(poolId: string, items: NewResource[]): Promise<ResourceRow[]> {
    return pg(() =>
      this.db.query(
        `INSERT INTO t_resource (pool_id, value, attributes, group_key)
         SELECT $1, v, a, g FROM unnest($2::varchar[], $3::jsonb[], $4::text[]) AS i(v, a, g)
         ON CONFLICT (pool_id, value) DO NOTHING
         RETURNING ${ROW}`,
        [poolId, items.map((i) => i.value), items.map((i) => JSON.stringify(i.attributes)), items.map((i) => i.groupKey)],
      ),
    );
  }

  async findById(poolId: string, id: string): Promise<ResourceRow | null> {
    const rows: ResourceRow[] = await pg(() => this.db.query(`SELECT ${ROW} FROM t_resource WHERE pool_id = $1 AND id = $2`, [poolId, id]));
    return rows[0] ?? null;
  }

  findMany(poolId: string, ids: string[]): Promise<ResourceRow[]> {
    return pg(() => this.db.query(`SELECT ${ROW} FROM t_resource WHERE pool_id = $1 AND id = ANY($2::bigint[])`, [poolId, ids]));
  }

  /**
   * The commit of DESIGN.md: one transaction with the version-checked
   * `UPDATE ... WHERE id = ? AND state = 1 AND version = ?` for every item, a history row for each, and
   * the commit record. All or nothing.
   */
  async allocate(a: Allocation): Promise<AllocationResult> {
    return pg(async () => {
      try {
        return await this.db.transaction(async (tx) => {
          // Shared with every other commit; a bump of the Redis generation waits for it (and we for a bump).
          // Its own statement, so that the next one reads the generation with a snapshot taken after it.
          await tx.query(`SELECT pg_advisory_xact_lock_shared($1)`, [GENERATION_LOCK]);
          let updated: { id: string }[];
          try {
            // One statement: the generation check, the epoch's decision, the version-checked UPDATE, a
            // history row per item.
            updated = await tx.query(
              `WITH gen AS (
                 SELECT 1 FROM t_redis_generation WHERE gen = $7
               ), decided AS (
                 INSERT INTO t_commit_decision (reservation_id, epoch, decision) SELECT $5, $6, 'commit' FROM gen
               ), chosen AS (
                 SELECT * FROM unnest($2::bigint[], $3::int[]) AS c(id, version)
               ), upd AS (
                 -- "r.id = ANY" lets the planner go through the primary key for the few rows chosen,
                 -- instead of through every free row of the pool.
                 UPDATE t_resource r
                    SET state = 2, version = r.version + 1, owner = $4, update_time = now()
                   FROM chosen c, gen
                  WHERE r.id = ANY($2::bigint[]) AND r.id = c.id AND r.pool_id = $1 AND r.state = 1 AND r.version = c.version
                 RETURNING r.id, r.version
               ), hist AS (
                 INSERT INTO t_allocation_history (resource_id, pool_id, action, owner, reservation_id, version)
                 SELECT id, $1, 'allocate', $4, $5, version FROM upd
               )
               SELECT id::text AS id FROM upd`,
              [a.poolId, a.items.map((i) => i.id), a.items.map((i) => i.version), a.owner, a.reservationId, a.epoch, a.generation],
            );
          } catch (err) {
            // The epoch was already ended: by a concurrent confirm of this reservation, or by the sweeper.
            if (sqlState(err) === '23505') throw new AllocationAborted('decided');
            throw err;
          }
          if (updated.length !== a.items.length) throw new AllocationAborted('conflict');
          try {
            await tx.query(
              `INSERT INTO t_commit (reservation_id, pool_id, owner, resource_ids, body) VALUES ($1, $2, $3, $4::bigint[], $5)`,
              [a.reservationId, a.poolId, a.owner, a.items.map((i) => i.id), JSON.stringify(a.body)],
            );
          } catch (err) {
            if (sqlState(err) === '23505') throw new AllocationAborted('duplicate');
            throw err;
          }
          return 'committed' as const;
        });
      } catch (err) {
        if (err instanceof AllocationAborted) return err.result;
        throw err;
      }
    });
  }

  /**
   * Records that a commit epoch is given up, unless its commit got there first (the insert waits for a
   * commit in flight). Returns who ended the epoch.
   */
  async decideAbort(reservationId: string, epoch: number): Promise<'commit' | 'abort'> {
    return pg(async () => {
      const inserted: unknown[] = await this.db.query(
        `INSERT INTO t_commit_decision (reservation_id, epoch, decision) VALUES ($1, $2, 'abort')
         ON CONFLICT (reservation_id, epoch) DO NOTHING RETURNING decision`,
        [reservationId, epoch],
      );
      if (inserted.length === 1) return 'abort';
      // A new statement, so a new snapshot: it sees the row whose commit the insert waited for.
      const rows: { decision: 'commit' | 'abort' }[] = await this.db.query(
        `SELECT decision FROM t_commit_decision WHERE reservation_id = $1 AND epoch = $2`,
        [reservationId, epoch],
      );
      return rows[0].decision;
    });
  }

  /** allocated -> free for this owner, version incremented, history row written. Null if not allocated to that owner. */
  async release(poolId: string, id: string, owner: string): Promise<ResourceRow | null> {
    const rows: ResourceRow[] = await pg(() =>
      this.db.query(
        `WITH upd AS (
           UPDATE t_resource SET state = 1, version = version + 1, owner = NULL, update_time = now()
            WHERE pool_id = $1 AND id = $2 AND state = 2 AND owner = $3
           RETURNING *
         ), hist AS (
           INSERT INTO t_allocation_history (resource_id, pool_id, action, owner, version)
           SELECT id, pool_id, 'release', $3, version FROM upd
         )
         SELECT ${ROW} FROM upd`,
        [poolId, id, owner],
      ),
    );
    return rows[0] ?? null;
  }

  /** One page of the pool's free rows, in id order, for the rebuild of the free index. */
  freePage(poolId: string, afterId: string, limit: number): Promise<ResourceRow[]> {
    return pg(() =>
      this.db.query(`SELECT ${ROW} FROM t_resource WHERE pool_id = $1 AND state = 1 AND id > $2 ORDER BY id LIMIT $3`, [
        poolId,
        afterId,
        limit,
      ]),
    );
  }
}

class AllocationAborted extends Error {
  constructor(readonly result: AllocationResult) {
    super(result);
  }
}
