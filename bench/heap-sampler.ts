/**
 * Preloaded into the service by `npm run bench:profile -- <scenario> [seconds] --heap` (node --import).
 * The first SIGUSR2 starts V8's sampling heap profiler, keeping the samples of objects the garbage
 * collector has since collected (so it counts what was allocated, not what is still alive); the second
 * stops it and writes the profile to the file named by RESPOOL_HEAP_PROFILE.
 */
import { renameSync, writeFileSync } from 'node:fs';
import { Session } from 'node:inspector';

const out = process.env.RESPOOL_HEAP_PROFILE;
if (!out) throw new Error('heap-sampler: RESPOOL_HEAP_PROFILE is not set');

const session = new Session();
session.connect();
let sampling = false;

process.on('SIGUSR2', () => {
  if (!sampling) {
    sampling = true;
    session.post('HeapProfiler.enable', () =>
      session.post('HeapProfiler.startSampling', {
        samplingInterval: 4096,
        includeObjectsCollectedByMajorGC: true,
        includeObjectsCollectedByMinorGC: true,
      }),
    );
    return;
  }
  session.post('HeapProfiler.stopSampling', (err, result) => {
    if (err) console.error(`heap-sampler: ${err.message}`);
    else {
      // Written whole, then renamed: the benchmark waits for the file to appear.
      writeFileSync(`${out}.part`, JSON.stringify(result.profile));
      renameSync(`${out}.part`, out);
    }
  });
});
