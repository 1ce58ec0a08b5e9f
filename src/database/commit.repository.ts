import { Injectable } from '@nestjs/common';
import { DataSource } from 'typeorm';
import { pg } from './postgres.js';

export interface CommitRow {
  reservationId: string;
  owner: string;
  resourceIds: string[];
  body: Record<string, unknown>;
}

/** A commit of a reservation made with an Idempotency-Key (its body's `idempotency`). */
export interface KeyedCommitRow {
  reservationId: string;
  key: string;
  bodyHash: string;
  /** When the reservation was made (Redis clock, ms): its key lasts IDEMPOTENCY_TTL_MS from then. */
  createdMs: number;
  /** The row's place in the walk (keyedSince's `after`): its created_at as text, exact, and its id. */
  at: string;
}

@Injectable()
export class CommitRepository {
  constructor(private readonly db: DataSource) {}

  async find(reservationId: string): Promise<CommitRow | null> {
    const rows: CommitRow[] = await pg(() =>
      this.db.query(
        `SELECT reservation_id AS "reservationId", owner, resource_ids::text[] AS "resourceIds", body
           FROM t_commit WHERE reservation_id = $1`,
        [reservationId],
      ),
    );
    return rows[0] ?? null;
  }

  /**
   * The pool's commits of keyed reservations recorded within the last `withinMs`, the newest first (of two with one
   * key, the later one is the key's), `limit` at a time: the next page starts after `after`, the last row's place
   * (index t_commit_keyed_idx).
   */
  keyedSince(poolId: string, withinMs: number, limit: number, after?: KeyedCommitRow): Promise<KeyedCommitRow[]> {
    return pg(async () => {
      const rows: (Omit<KeyedCommitRow, 'createdMs'> & { createdMs: string })[] = await this.db.query(
        `SELECT reservation_id AS "reservationId", body #>> '{idempotency,key}' AS key,
                body #>> '{idempotency,bodyHash}' AS "bodyHash", body #>> '{idempotency,createdMs}' AS "createdMs",
                created_at::text AS at
           FROM t_commit
          WHERE pool_id = $1 AND body ? 'idempotency' AND created_at > now() - $2 * interval '1 millisecond'
            AND (created_at, reservation_id) < ($3::timestamptz, $4)
          ORDER BY created_at DESC, reservation_id DESC
          LIMIT $5`,
        [poolId, withinMs, after?.at ?? 'infinity', after?.reservationId ?? '', limit],
      );
      return rows.map((row) => ({ ...row, createdMs: Number(row.createdMs) }));
    });
  }
}
