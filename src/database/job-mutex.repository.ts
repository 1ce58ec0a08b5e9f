import { Injectable } from '@nestjs/common';
import { DataSource } from 'typeorm';
import { pg } from './postgres.js';

/**
 * Run-once jobs across instances (DESIGN.md): read the row's version, then
 * `UPDATE ... WHERE version = <read>`; the one instance whose update changes a row runs the job.
 * A holder that dies is replaced once its lease has run out.
 */
@Injectable()
export class JobMutexRepository {
  constructor(private readonly db: DataSource) {}

  async tryAcquire(jobType: string, holder: string, leaseMs: number): Promise<boolean> {
    return pg(async () => {
      const rows: { version: string; holder: string | null; stale: boolean }[] = await this.db.query(
        `SELECT version::text AS version, holder, update_time < now() - make_interval(secs => $2 / 1000.0) AS stale
           FROM t_job_mutex WHERE job_type = $1`,
        [jobType, leaseMs],
      );
      if (rows.length === 0) {
        await this.db.query(`INSERT INTO t_job_mutex (job_type) VALUES ($1) ON CONFLICT DO NOTHING`, [jobType]);
        return this.tryAcquire(jobType, holder, leaseMs);
      }
      const row = rows[0];
      if (row.holder !== null && row.holder !== holder && !row.stale) return false;
      const won: unknown[] = await this.db.query(
        `WITH won AS (
           UPDATE t_job_mutex SET version = version + 1, holder = $3, update_time = now()
            WHERE job_type = $1 AND version = $2 RETURNING version
         ) SELECT version FROM won`,
        [jobType, row.version, holder],
      );
      return won.length === 1;
    });
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
