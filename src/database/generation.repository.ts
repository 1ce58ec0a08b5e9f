import { Injectable } from '@nestjs/common';
import { DataSource, EntityManager } from 'typeorm';
import { pg } from './postgres.js';

/** pg_advisory lock key of the Redis generation: commits take it shared, the bump exclusive. */
export const GENERATION_LOCK = 7_361_905_022;

/**
 * The Redis generation (t_redis_generation). A rebuild after Redis was wiped bumps it; a commit only
 * lands in the generation its holds were taken in. And the Redis checkpoint (t_redis_checkpoint, see
 * RebuildService.checkpoint), which tells when Redis went back in time.
 */
@Injectable()
export class GenerationRepository {
  constructor(private readonly db: DataSource) {}

  async current(): Promise<number> {
    const rows: { gen: string }[] = await pg(() => this.db.query(`SELECT gen::text AS gen FROM t_redis_generation`));
    return Number(rows[0].gen);
  }

  /**
   * Waits for every commit in flight (they hold the lock shared), then moves to a new generation. `fence` runs
   * in the same transaction first (the rebuild renews its job lease there): if it answers false, nothing
   * changes and the bump answers null.
   */
  async bump(fence: (tx: EntityManager) => Promise<boolean> = async () => true): Promise<number | null> {
    return pg(() =>
      this.db.transaction(async (tx) => {
        await tx.query(`SELECT pg_advisory_xact_lock($1)`, [GENERATION_LOCK]);
        if (!(await fence(tx))) return null;
        const rows: { gen: string }[] = await tx.query(
          `WITH bumped AS (UPDATE t_redis_generation SET gen = gen + 1 RETURNING gen) SELECT gen::text AS gen FROM bumped`,
        );
        return Number(rows[0].gen);
      }),
    );
  }

  /** Postgres' Redis checkpoint. */
  async checkpoint(): Promise<number> {
    const rows: { n: string }[] = await pg(() => this.db.query(`SELECT n::text AS n FROM t_redis_checkpoint`));
    return Number(rows[0].n);
  }

  /**
   * Raises Postgres' Redis checkpoint from `from` to `to`, if it was last raised `minGapMs` ago or more (however many
   * instances try: a step takes about as long whatever their number; or if it was raised "later" than now, by a clock
   * that Postgres has since set back); false, and nothing changed, if it no longer was `from` (another instance raised
   * it) or was raised too recently.
   */
  async advanceCheckpoint(from: number, to: number, minGapMs: number): Promise<boolean> {
    // As a SELECT: TypeORM answers an UPDATE's query with [rows, count].
    const rows: unknown[] = await pg(() =>
      this.db.query(
        `WITH raised AS (
           UPDATE t_redis_checkpoint SET n = $2, raised_at = now()
            WHERE n = $1 AND (raised_at <= now() - $3 * interval '1 millisecond' OR raised_at > now()) RETURNING n)
         SELECT n FROM raised`,
        [from, to, minGapMs],
      ),
    );
    return rows.length === 1;
  }
}
