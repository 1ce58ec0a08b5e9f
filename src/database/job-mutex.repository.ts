import { Injectable } from '@nestjs/common';
import { DataSource, EntityManager } from 'typeorm';
import { pg } from './postgres.js';

/**
 * Run-once jobs across instances (DESIGN.md): read the row's version, then
 * `UPDATE ... WHERE version = <read>`; the one instance whose update changes a row runs the job.
 * A holder that dies is replaced once its lease has run out.
 */
@Injectable()
export class JobMutexRepository {
  constructor(private readonly db: DataSource) {}

  /**
   * Takes the job's lease, or renews it if this holder has it. Returns the lease's version, the fencing token of
   * this holding (see renew), or null while another holder's lease runs.
   */
  async acquire(jobType: string, holder: string, leaseMs: number): Promise<string | null> {
    return pg(async () => {
      const rows: { version: string; holder: string | null; stale: boolean }[] = await this.db.query(
        `SELECT version::text AS version, holder, update_time < now() - make_interval(secs => $2 / 1000.0) AS stale
           FROM t_job_mutex WHERE job_type = $1`,
        [jobType, leaseMs],
      );
      if (rows.length === 0) {
        await this.db.query(`INSERT INTO t_job_mutex (job_type) VALUES ($1) ON CONFLICT DO NOTHING`, [jobType]);
        return this.acquire(jobType, holder, leaseMs);
      }
      const row = rows[0];
      if (row.holder !== null && row.holder !== holder && !row.stale) return null;
      return this.bump(jobType, row.version, holder);
    });
  }

  /**
   * Extends a lease held at `version`. Returns the new version, or null if the job changed hands since (its
   * lease ran out while this holder was paused, and another took it, even one that has released it again):
   * the holder must then stop, because the other may have done, or be doing, the same work. Given `tx`, it runs
   * in that transaction, so a write there lands only under the lease (and the lease stays locked until it ends).
   */
  async renew(jobType: string, holder: string, version: string, tx?: EntityManager): Promise<string | null> {
    return pg(() => this.bump(jobType, version, holder, true, tx));
  }

  /**
   * The version CAS: takes the row for `holder` with a fresh update_time if it is still at `version` (and, with
   * `held`, still `holder`'s). Returns the new version, or null.
   */
  private async bump(jobType: string, version: string, holder: string, held = false, tx?: EntityManager): Promise<string | null> {
    // (TypeORM answers a bare UPDATE ... RETURNING with its affected count too; a CTE answers rows only.)
    const won: { version: string }[] = await (tx ?? this.db).query(
      `WITH won AS (
         UPDATE t_job_mutex SET version = version + 1, holder = $3, update_time = now()
          WHERE job_type = $1 AND version = $2 AND (NOT $4 OR holder = $3) RETURNING version
       ) SELECT version::text AS version FROM won`,
      [jobType, version, holder, held],
    );
    return won[0]?.version ?? null;
  }

  async release(jobType: string, holder: string): Promise<void> {
    await pg(() =>
      this.db.query(
        `UPDATE t_job_mutex SET version = version + 1, holder = NULL, update_time = now()
          WHERE job_type = $1 AND holder = $2`,
        [jobType, holder],
      ),
    );
  }
}
